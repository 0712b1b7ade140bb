"""The OpenAI-compatible HTTP server (`llmc serve`); needs the [serve] extra."""
