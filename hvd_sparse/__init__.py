"""hvd_sparse: sparse gradient communication for Horovod."""
__version__ = "0.1.0"
