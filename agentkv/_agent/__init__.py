"""The agent runtime: tools, tool sets, tool-calling protocols, events, Agent/AsyncAgent."""
