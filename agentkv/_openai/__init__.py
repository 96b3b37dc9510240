"""agentkv.OpenAI / AsyncOpenAI: openai-SDK clients served in-process by the proxy's app."""
