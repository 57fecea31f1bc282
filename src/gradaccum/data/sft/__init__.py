"""Fine-tuning data: rows read (`rows`, `load`), tokenized into examples with their targets
(`examples`), dealt into windows over ranks (`windows`), cut into micro-batches by `--packing`
(`packing`, `packed`), evaluated (`evaluation`); the built-in instruction set (`builtin`)."""
