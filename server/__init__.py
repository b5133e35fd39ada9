"""Siesta's front end: the command line and (later) the HTTP server."""
