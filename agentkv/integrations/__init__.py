"""Integrations with other agent frameworks, each an optional extra.

* ``agentkv.integrations.langchain.ChatAgentKV``: a LangChain chat model on an agentkv session
  (``pip install 'agentkv[langchain]'``).

Nothing is imported here, so ``import agentkv.integrations`` never needs a framework installed.
"""
