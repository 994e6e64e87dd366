"""What this project adds to TorchServe 0.12.0's Java frontend: queued batching, a batching
policy the frontend lacks (ContinuousBatching.java), and a stop without Netty's 2-second quiet
period (ServerGroups.java), put in place by a Java agent (Agent.java) that `torchserve-vision
server` names in the effective config's `vmargs`. torchserve_vision.
frontend.agent builds the agent's jar with `javac` against the installed TorchServe and finds it.
"""
