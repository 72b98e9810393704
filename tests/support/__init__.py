"""Real components the tests run against: a moto S3 server, a fault-injecting proxy, helpers."""
