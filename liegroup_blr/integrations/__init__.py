"""The optimizers inside other training stacks, as optional extras.

- :mod:`liegroup_blr.integrations.lightning` (``pip install liegroup_blr[lightning]``):
  :class:`~liegroup_blr.integrations.lightning.BLRCallback`, one line in a Lightning
  ``Trainer``.
- :mod:`liegroup_blr.integrations.transformers` (``pip install liegroup_blr[transformers]``):
  :class:`~liegroup_blr.integrations.transformers.BLRTrainer` (a Hugging Face ``Trainer``)
  and :class:`~liegroup_blr.integrations.transformers.BLRTrainerCallback`.

Importing this package imports neither library: import the submodule you need.
"""

__all__: list[str] = []
