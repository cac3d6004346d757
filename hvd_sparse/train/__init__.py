"""Training entry point for real workloads: ``python -m hvd_sparse.train`` under horovodrun."""
