"""The built documentation reads offline: no page loads anything from the network.

    python .ci/check_docs_offline.py docs/_build/html

Every <script src> and <link href> of every page is local and names a file that exists in
the build, and every page with mathematics loads the MathJax copied into the build
(sphinx-mathjax-offline), whose fonts are there too.
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path

MATHJAX = "_static/mathjax/tex-chtml.js"
MATHJAX_FONTS = "_static/mathjax/output/chtml/fonts/woff-v2"
REMOTE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.I)  # http://, https://, //host/...


class Resources(HTMLParser):
    """The URLs a page loads: script sources and linked stylesheets, icons, preloads."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        url = dict(attrs).get({"script": "src", "link": "href"}.get(tag, ""))
        if url and not (tag == "link" and dict(attrs).get("rel") in ("canonical", "next", "prev")):
            self.urls.append(url)


def problems(build: Path) -> list[str]:
    found = []
    for mathjax in (MATHJAX, MATHJAX_FONTS):
        if not (build / mathjax).exists():
            found.append(f"{mathjax} is missing from the build")
    pages = sorted(build.rglob("*.html"))
    if not pages:
        found.append(f"no pages in {build}")
    for page in pages:
        name = page.relative_to(build).as_posix()
        html = page.read_text(encoding="utf-8")
        parser = Resources()
        parser.feed(html)
        local = []
        for url in parser.urls:
            if REMOTE.match(url):
                found.append(f"{name} loads {url} from the network")
            elif not url.startswith(("data:", "#")):
                path = (page.parent / url.split("?")[0].split("#")[0]).resolve()
                local.append(path)
                if not path.exists():
                    found.append(f"{name} loads {url}, which is not in the build")
        if 'class="math' in html and (build / MATHJAX).resolve() not in local:
            found.append(f"{name} has mathematics but does not load {MATHJAX}")
    return found


def main() -> None:
    build = Path(sys.argv[1])
    found = problems(build)
    if found:
        sys.exit("check_docs_offline:\n  " + "\n  ".join(found))
    print(f"check_docs_offline: {len(list(build.rglob('*.html')))} pages load nothing remote")


if __name__ == "__main__":
    main()
