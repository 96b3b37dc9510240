"""A ``sitecustomize`` that limits the ISA torch and vLLM see (``AGENTKV_CPU_ISA``, see ``_cpu``).

This folder is put first on a vLLM server's ``PYTHONPATH`` only when an ISA limit is asked for.
"""
