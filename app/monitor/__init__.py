"""The monitor: live decode speed, KV pages, VRAM and RAM, from the local engine or a remote server."""
