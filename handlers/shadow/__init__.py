"""Shadow traffic: the policy file, copying requests to a candidate version, comparing answers."""
