"""Floor-one utilities with no model knowledge: files and fsspec storage, devices and seeds."""
