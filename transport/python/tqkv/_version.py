"""The tqkv release this package belongs to: the project() version of CMakeLists.txt
(transport/CMakeLists.txt refuses to configure when the two differ)."""
__version__ = "0.1.0"
