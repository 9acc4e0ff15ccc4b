"""Vision-language models: per-family bundles, processors built in code, image loading, packed forwards with images."""
