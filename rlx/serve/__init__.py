"""The OpenAI-compatible endpoint: HTTP server, per-sample sessions, request images and the stream feeding the
engine.
"""
