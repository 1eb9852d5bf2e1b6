"""One compile cache for the whole suite: the trainer's default puts it beside each run directory, which
in tests is a fresh temporary directory, so every compiled test would compile cold. The runs' processes
inherit it (tests/test_compile_cache.py removes it to test the default)."""
import os
import tempfile

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "torchinductor_suite"))
