grpolens metrics --family entropy
grpolens metrics --profile trl
