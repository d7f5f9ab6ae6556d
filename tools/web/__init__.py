"""The online channel: search providers (serialized, rate-limited), the page reader, the web channel."""
