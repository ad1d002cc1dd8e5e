"""prefixcache.worker"""
