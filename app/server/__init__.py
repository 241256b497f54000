"""The server panel: address, LAN and API key, the remote server dialog, and the logs view."""
