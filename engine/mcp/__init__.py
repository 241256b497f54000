"""MCP (Model Context Protocol) tools for a chat, Qt-free, on the official ``mcp`` SDK: the servers of an
``mcp.json`` (config.py), a session per server on a thread of its own (client.py, host.py), the tools offered to a
model as OpenAI function tools (names.py), and the "always allow" choices (approvals.py). See docs/MCP.md."""
