"""Graph passes: the framework (manager, pattern, rewrite), one module per pass, and the pipeline."""
