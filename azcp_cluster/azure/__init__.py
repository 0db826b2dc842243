"""Azure Blob Storage: credentials (keys, SAS, tokens from azure-identity), TLS and proxies, and
the listing client."""
