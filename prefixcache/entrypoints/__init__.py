"""prefixcache.entrypoints"""
