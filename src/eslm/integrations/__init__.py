"""ESLM inside other training stacks (``hf``, ``lightning``, ``torchtitan``), one module each, importing its stack
only when used; docs/dropin.md has the table of stacks, snippets and normalisations."""
