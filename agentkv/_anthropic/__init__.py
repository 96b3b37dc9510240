"""``agentkv.Anthropic`` / ``agentkv.AsyncAnthropic``: the anthropic SDK served in-process."""
