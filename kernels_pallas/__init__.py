"""Pallas kernels, each next to a pure-JAX reference of the same signature.

The model calls the reference on CPU and the kernel on GPU; tests run kernels with interpret=True.
"""
