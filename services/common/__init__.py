"""Code shared by two or more services. Imports no service, and nothing here but nets.py imports torch."""
