"""Ways to start agents: one provider per `launch:` kind (local, ssh, slurm, ray) behind one
interface (base.py), and rendered manifests for Kubernetes (kubernetes.py).

The lifeline rule holds for every provider: when `hetlaunch up` ends, the agents it started end.
"""
