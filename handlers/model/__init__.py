"""Loading and running a network: settings, loading, precision, compiled packages and
the check of their answers."""
