"""The token-exact prompt: the append-only transcript and chat-template deltas."""
