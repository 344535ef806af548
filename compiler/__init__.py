"""Compiler: checkpoint readers, ModelSpec, weight passes, memory planner, engine writer."""
