"""The model commands (`ncm pull`, `ncm import`, `ncm generate`), also runnable alone."""
