"""Fakes of the engine interfaces nucleus plugs into (vLLM, SGLang), for tests that run without
the engines: each module builds a module tree to put into ``sys.modules``."""
