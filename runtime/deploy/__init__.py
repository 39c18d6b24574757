"""Running sandboxes elsewhere: Kubernetes manifests for shared services, and the AppArmor profile for hosts that
confine containers with it."""
