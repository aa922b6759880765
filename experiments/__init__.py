"""Gin-configured experiment scripts. Gin lives here, in configs/ and in the CLI only."""
