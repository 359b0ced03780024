"""Fleet CA, device and gateway certificates, broker configs and manifest signing.

Not implemented yet (tracked as the provisioning-and-security issue); no command is
registered for it until it is.
"""
