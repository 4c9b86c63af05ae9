"""Decode loops. Each method compiles to one program per static shape bucket."""
