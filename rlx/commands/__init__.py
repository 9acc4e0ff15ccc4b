"""One thin module per command: options -> config -> one engine call -> artifacts."""
