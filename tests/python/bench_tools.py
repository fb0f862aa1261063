"""The Python benchmark tools of tools/bench, loaded as modules (they are scripts, not a package)."""
import importlib.util
import pathlib

_DIR = pathlib.Path(__file__).resolve().parents[2] / "tools" / "bench"


def load(script):
    """tools/bench/<script>.py as a module."""
    spec = importlib.util.spec_from_file_location(f"dfss_bench_{script}", _DIR / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
