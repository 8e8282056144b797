"""Deployments beyond one machine: ``kvrelay deploy k8s`` renders Kubernetes manifests."""
