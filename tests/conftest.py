"""Every metric, profile and visitor registered once for the whole session, as the commands do
before they use the registry (modules that read ``REGISTRY`` or ``PROFILES`` directly rely on it)."""

from grpolens.plugins import load_plugins

load_plugins()
