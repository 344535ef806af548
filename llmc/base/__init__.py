"""The vocabulary every layer shares and that imports nothing else from llmc: the error
classes with their exit codes (``errors``) and the version numbers (``version``)."""
