"""gradaccum: gradient accumulation for PyTorch, exact over tokens, planned and measured."""

__version__ = "0.1.0"

__all__ = ["Accumulator", "StepResult", "verify", "windows", "__version__"]


def __getattr__(name):
    # Lazy, so that `gradaccum plan` (pure arithmetic) starts without importing torch.
    if name in ("Accumulator", "StepResult", "windows"):
        from gradaccum import engine

        return getattr(engine, name)
    if name == "verify":
        # the function; its module is gradaccum.verification (a module of the same name as
        # the function would replace it here once imported)
        from gradaccum.verification.check import verify

        return verify
    raise AttributeError(name)
