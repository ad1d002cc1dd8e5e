"""prefixcache.events"""
