"""The core: keys and scopes, fingerprints, the pure decision table, and the one I/O shell that
runs its decisions against the store, the transactions and the heartbeat; stored responses
and their codecs; signals' payloads and metrics' hooks.
"""
