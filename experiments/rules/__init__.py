"""Studies of one rule's behaviour: the multiplicative rule's walk in log g, the affine
rule's scale against its fixed point."""
