"""llmc's version, in a module of its own so that any part of llmc can name it (EngineWriter stamps
it into each manifest, the build report and `llmc --version` print it) without importing the
package `llmc`, whose __init__ reaches up to the runtime. Keep it equal to pyproject.toml's."""

__version__ = "0.1.0"
