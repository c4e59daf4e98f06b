"""Wire formats as sans-IO codecs: bytes in, messages out, and back; no sockets here."""
