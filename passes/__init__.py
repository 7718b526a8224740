"""fxpar.passes: one graph pass per file; see passes/README.md for each contract."""
