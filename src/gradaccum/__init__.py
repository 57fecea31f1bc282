"""gradaccum: gradient accumulation for PyTorch, exact over tokens, planned and measured."""

__version__ = "0.1.0"

__all__ = ["Accumulator", "StepResult", "windows", "__version__"]


def __getattr__(name):
    # Lazy, so that `gradaccum plan` (pure arithmetic) starts without importing torch.
    if name in ("Accumulator", "StepResult", "windows"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(name)
