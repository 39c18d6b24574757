"""Sandbox images: one per package set, from a base image (pulled, or built offline) and host-side downloads of pip and
Debian packages."""
