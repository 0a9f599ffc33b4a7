"""A package of the SGLang stand-in (see sglang/__init__.py)."""
