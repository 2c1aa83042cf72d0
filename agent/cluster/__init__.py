"""Membership and trust: peers, discovery (mDNS and static), the signed peer client, TLS, pairing and removal."""
